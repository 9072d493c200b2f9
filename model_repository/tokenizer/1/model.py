"""tokenizer: text or chat messages -> prompt token ids (chat template applied here)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg import contracts as P
from disagg.engine.tokenizer import Tokenizer
from disagg.triton import pb

INPUTS = {P.TEXT_INPUT: "str", P.MESSAGES: "str", P.APPLY_CHAT_TEMPLATE: "bool"}


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        self.tokenizer = Tokenizer(pb.model_parameters(args).engine_dir)

    def execute(self, requests):
        return [self._encode(r) for r in requests]

    def _encode(self, request):
        try:
            f = pb.read_fields(request, INPUTS, batched=True)
            ids = self.tokenizer.encode_prompt(
                f.get(P.TEXT_INPUT, ""), f.get(P.MESSAGES, ""), f.get(P.APPLY_CHAT_TEMPLATE, False)
            )
            return pb_utils.InferenceResponse([pb.tensor(P.INPUT_IDS, ids, np.int32, batched=True)])
        except Exception as e:
            return pb.error_response(e)
