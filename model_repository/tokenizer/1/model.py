"""tokenizer: text or chat messages -> prompt token ids (chat template applied here)."""

from disagg.codec.generate import TokenizeCall, TokenizeResponse
from disagg.engine.tokenizer import Tokenizer
from disagg.model_params import TokenizerParams
from disagg.triton import pb


class TritonPythonModel:
    def initialize(self, args):
        pb.configure_logging()
        self.tokenizer = Tokenizer(pb.model_parameters(args).typed(TokenizerParams).engine_dir)

    def execute(self, requests):
        return [self._encode(r) for r in requests]

    def _encode(self, request):
        try:
            text, messages, chat = TokenizeCall.decode(
                pb.input_arrays(request, TokenizeCall.TENSORS.names)
            )
            ids = self.tokenizer.encode_prompt(text, messages, chat)
            return pb.response(pb.tensors(TokenizeResponse.encode(ids)))
        except Exception as e:
            return pb.error_response(e)
