"""The built-in torch LLM engine (plugin ``torch``, in ``engine``): its KV helpers and KV tiers."""
