"""Cross-process cancellation by marker files, and the request ids it is addressed by."""

from __future__ import annotations

import pytest

from disagg.cancel import CancelRegistry
from disagg.contracts import child_request_id, new_request_id

pytestmark = pytest.mark.unit


def test_a_mark_on_a_callers_id_cancels_the_ids_that_extend_it(tmp_path):
    reg = CancelRegistry(tmp_path)
    router_id = new_request_id()
    orch_id = child_request_id(router_id)
    other = child_request_id(new_request_id())
    assert orch_id.startswith(router_id + ".")
    assert not reg.is_marked(orch_id)
    reg.mark(router_id)
    assert reg.is_marked(orch_id) and reg.is_marked(router_id) and not reg.is_marked(other)
    reg.clear(router_id)
    assert not reg.is_marked(orch_id)


def test_ids_are_unique_and_file_name_safe_whatever_the_client_sends(tmp_path):
    reg = CancelRegistry(tmp_path)
    ids = {new_request_id("../../etc/passwd") for _ in range(100)}
    assert len(ids) == 100
    for rid in ids:
        reg.mark(rid)  # would raise for an unsafe name
        assert "/" not in rid and rid.startswith("etcpasswd-")
    assert child_request_id("../x").count(".") == 0  # unsafe caller ids are not extended
    assert child_request_id("a" * 200).count(".") == 0  # nor are huge ones
    assert not reg.is_marked("../x")
