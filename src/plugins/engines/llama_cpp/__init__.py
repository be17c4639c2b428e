"""The built-in llama.cpp LLM engine (plugin ``llama-cpp``, in ``engine``): its sequences, batch planner,
options, files, CPU backend choice, sliding windows, KV tiers, and documents' KV placed at any position."""
