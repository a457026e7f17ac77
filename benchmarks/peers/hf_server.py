"""A minimal OpenAI-compatible adapter around Hugging Face `generate`, so the same `specstand bench`
measures HF plain greedy and HF prompt lookup side by side with specstand and vLLM. One request at a
time (HF generate has no continuous batching); greedy only.

    python benchmarks/peers/hf_server.py --model qwen2.5-coder-0.5b --port 8201 [--prompt-lookup 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import uvicorn
from fastapi import FastAPI
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specstand.models.loading import DTYPES, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--port", type=int, default=8201)
    parser.add_argument("--prompt-lookup", type=int, default=0, help="prompt_lookup_num_tokens (0: plain)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    # One thread loads the model and runs every generate, as specstand's engine thread does (server/worker.py):
    # OpenMP keeps a team per thread that starts parallel work, and with a second one libgomp stops spinning
    # between regions, which doubled the cost of specstand's decode steps
    torch_thread = ThreadPoolExecutor(max_workers=1)
    load = torch_thread.submit(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval())
    hf = load.result()
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    stop = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    app = FastAPI()
    name = f"hf-{'lookup' if args.prompt_lookup else 'plain'}"

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        extra = {"prompt_lookup_num_tokens": args.prompt_lookup} if args.prompt_lookup else {}
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=stop,
                              pad_token_id=stop[0], **extra)
        return out[0, len(ids):].tolist()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # one generate at a time (the executor has one thread), off the event loop so that it keeps serving
        tokens = await asyncio.get_running_loop().run_in_executor(torch_thread, generate, ids,
                                                                  int(body.get("max_tokens") or 256))
        finish = "stop" if tokens and tokens[-1] in stop else "length"
        return {"id": "hf", "object": "chat.completion", "created": int(time.time()), "model": name,
                "choices": [{"index": 0, "finish_reason": finish,
                             "message": {"role": "assistant",
                                         "content": tokenizer.decode(tokens, skip_special_tokens=True)}}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
