"""The layout keeps its promises (docs/architecture.md): small modules, Triton only in the
adapter, tensor names only in contracts.py, and no torch in model processes that never run
the model."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from disagg import contracts as C

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "disagg"
FAKES = ROOT / "tests" / "fakes"
MAX_LINES = 400


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_adapter_imports_the_python_backend():
    users = {
        str(p.relative_to(SRC)) for p in _modules() if "triton_python_backend_utils" in _imports(p)
    }
    assert users and all(u.startswith("triton/") for u in users), users


@pytest.mark.parametrize("package", ["pipeline", "routing"])
def test_orchestration_and_routing_know_no_triton(package):
    for path in (SRC / package).glob("*.py"):
        triton = {
            m for m in _imports(path) if m.startswith(("triton", "tritonclient", "disagg.triton"))
        }
        assert triton == set(), path.name


# Tensor names that mean nothing outside Triton's models (OpenAI shares max_tokens, stream...)
TRITON_ONLY = {
    C.TEXT_INPUT,
    C.TEXT_OUTPUT,
    C.NUM_INPUT_TOKENS,
    C.NUM_OUTPUT_TOKENS,
    C.INPUT_IDS,
    C.KV_PAYLOAD,
    C.ROUTE_TARGET,
    C.ROUTE_REASON,
    C.ERROR_KIND,
    C.WORKER_PID,
}


def test_tensor_names_are_spelled_only_in_contracts():
    spelled = set()
    for path in _modules():
        if path.name == "contracts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in TRITON_ONLY:
                spelled.add(f"{path.relative_to(SRC)}: {node.value}")
    assert spelled == set()


def test_stubs_that_never_run_the_model_do_not_import_torch():
    """Each of these model.py files, imported as its stub imports it (against the pb_utils
    stand-in), leaves torch unloaded: ~75 MB per stub instead of ~260 (docs/benchmarks.md)."""
    models = ["router", "orchestrator", "tokenizer"]
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(FAKES)!r})\n"
        f"for m in {models!r}:\n"
        f"    path = {str(ROOT / 'model_repository')!r} + f'/{{m}}/1/model.py'\n"
        "    spec = importlib.util.spec_from_file_location(f'model_{m}', path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    decode = code.replace(repr(models), repr(["decode"]))
    out = subprocess.run([sys.executable, "-c", decode], capture_output=True, text=True, check=True)
    assert "'torch'" in out.stdout  # the check can fail: decode does load it


# what only the pools' callers and models need: a router process never loads it
POOL_CODE = {
    "disagg.codec.pools",
    "disagg.kvnet",
    "disagg.pipeline.decode_service",
    "disagg.pipeline.local",
    "disagg.remote.pools",
    "disagg.triton.decode_side",
    "disagg.triton.pools",
    "disagg.triton.prefill_side",
}


def test_the_router_loads_no_pool_code_even_lazily():
    """The router model's imports, followed through every disagg import (those inside
    functions too), never reach the pools' code; and importing it as its stub does loads
    none of it."""
    graph = _import_graph()
    tree = ast.parse((ROOT / "model_repository" / "router" / "1" / "model.py").read_text())
    todo = [
        f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in graph else n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("disagg")
        for a in n.names
    ]
    reached: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph.get(module, ())
    assert "disagg.triton.local_pipeline" in reached and reached & POOL_CODE == set()
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(FAKES)!r})\n"
        f"path = {str(ROOT / 'model_repository' / 'router' / '1' / 'model.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('model_router', path)\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(n for n in sys.modules if n.startswith('disagg')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout.strip()))
    assert "disagg.triton.local_pipeline" in loaded and loaded & POOL_CODE == set()


def test_the_request_path_in_the_architecture_doc_names_real_functions():
    """docs/architecture.md walks a request naming `file` `function` at each hop: each one
    must exist, so a newcomer lands on it."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    pairs = re.findall(r"`([\w/]+\.py)` `([A-Za-z_][\w.]*)`", doc)
    assert len(pairs) >= 15
    for file, name in pairs:
        path = ROOT / file if file.startswith("model_repository/") else SRC / file
        assert path.is_file(), file
        tree = ast.parse(path.read_text())
        defined = {
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        missing = [part for part in name.split(".") if part not in defined]
        assert not missing, f"{file}: {name}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """disagg module -> the disagg modules it imports, lazily (inside functions) or not."""
    known = {_module_name(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module in known:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in known else node.module)
        name = _module_name(path)
        graph[name] = edges - {name}
    return graph


def test_no_import_cycle():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_engine_layers_have_a_package_of_their_own():
    engine = {p.stem for p in (SRC / "engine").glob("*.py")}
    assert {"model", "scheduler", "block_manager", "sequence", "llm_engine"} <= engine
    top = {p.stem for p in SRC.glob("*.py")}
    assert top.isdisjoint(engine - {"__init__"}), top & engine


def test_test_file_basenames_are_unique():
    """pytest imports test modules by basename (rootdir-relative, no packages): two files
    of one name in different layers stop the whole run at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
