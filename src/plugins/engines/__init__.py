"""The built-in engines, by concern; layers import only downward:

- ``models``: model files: a config's model path or ``hf:`` reference, GGUF conversion and caches.
- ``kvreuse``: reusing KV across prompts, engine-neutral: the prefix cache and the KV store's tiers.
- ``llm``: the shared LLM engine: the front (event loop) and the core's base (its thread), the messages
  between them, chat templates, sampling, constraints, prompt scores, preemption.
- ``llama_cpp`` and ``torch_engine``: the two built-in LLM engines, cores on ``llm``.
- ``retrieval``: embedders, rerankers and the vector store.
"""
