"""The shared LLM engine: the front on the event loop (``front``), the core's base on its own thread (``core``),
the messages between them (``messages``), and what every core uses: chat templates, sampling, output
constraints, prompt scores, preemption, a core over engines that take whole token lists (``token_lists``)."""
