"""The model on CPU (torch), one module per layer: `config` (architecture and limits),
`checkpoint`/`gguf`/`hf`/`build` (checkpoint -> engine directory), `tokenizer`, `kernels`,
`quant` (+ qmatmul.c: the checkpoint's quantized blocks) and `model` (the Llama decoder),
`sampling`, `sequence` (one request's state), `block_manager` and `scheduler` (torch-free
continuous batching), `kv_payload` (the hand-off bytes), `prefill_engine` and `llm_engine`
(`PrefillEngine`, `DecodeEngine`). Importing this package loads nothing: stubs that never
run the model import `tokenizer` or `sequence` without torch."""
