"""KV reused across prompts, engine-neutral: the prefix cache (cells kept on the engine) and the KV store
(host memory and disk tiers below it). Each engine's tiers adapt the store to its KV."""
