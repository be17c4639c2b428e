"""The float32 reference: Hugging Face transformers on the same GGUF file an engine serves.

transformers dequantises the GGUF's weights (Q4_0, Q4_1, Q8_0, F16...) to float32 and runs its own PyTorch
implementation of the architecture: code no one here wrote, in a precision above every engine's. So the difference
between an engine and this reference on the same file is what the engine's kernels, build and dtype do to the
numbers, not what the quantization does (the file is the same).

Loading parses the GGUF with transformers' reader: tens of seconds for SmolLM2-135M on 2 cores (``load_seconds``
says how long it took); callers cache what they compute. Threads: whatever torch is given (``torch.set_num_threads``
or ``OMP_NUM_THREADS``); the reference's numbers do not depend on it beyond float32 summation order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Reference:
    """A float32 causal LM and its tokenizer, read from one GGUF file by transformers; eval mode, no grad."""

    path: Path
    model: Any
    tokenizer: Any
    load_seconds: float

    @classmethod
    def load(cls, gguf_path: Path) -> "Reference":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(gguf_path)
        t0 = time.monotonic()
        with torch.inference_mode():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return cls(path, model, tokenizer, time.monotonic() - t0)

    @property
    def vocab_size(self) -> int:
        """The width of the logits: the output layer's rows (the embeddings' may be padded past the tokenizer's)."""
        return int(self.model.get_output_embeddings().out_features)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end tokens: its generation config's and its tokenizer's."""
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) | {self.tokenizer.eos_token_id}
        return frozenset(int(t) for t in ids if t is not None)

    def logprob_rows(self, tokens: Sequence[int]) -> torch.Tensor:
        """log-softmax rows, float32, shape (len(tokens), vocab): row i is the distribution of the token after
        ``tokens[:i + 1]`` (one forward pass, teacher-forced)."""
        if not tokens:
            raise ValueError("logprob_rows needs at least one token")
        with torch.inference_mode():
            ids = torch.tensor([list(tokens)], dtype=torch.long)
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
            return torch.log_softmax(logits.to(torch.float32), dim=-1)

    def greedy(self, tokens: Sequence[int], n: int, *, stop_at_eos: bool = False) -> list[int]:
        """The reference's greedy continuation of ``tokens``: ``n`` tokens, each the argmax after the ones before.

        By default an EOS does not end it (it is kept and decoding goes on), so every answer has ``n`` tokens and
        answers compare position by position; ``stop_at_eos``: end at the first EOS, which is kept."""
        if not tokens:
            raise ValueError("greedy needs at least one token")
        out: list[int] = []
        eos = self.eos_token_ids if stop_at_eos else frozenset()
        with torch.inference_mode():
            past = None
            step = torch.tensor([list(tokens)], dtype=torch.long)
            while len(out) < n:
                result = self.model(input_ids=step, past_key_values=past, use_cache=True)
                past = result.past_key_values
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                if token in eos:
                    break
                step = torch.tensor([[token]], dtype=torch.long)
        return out

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A chat's prompt as the model's own template renders it, with the assistant's turn opened."""
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
