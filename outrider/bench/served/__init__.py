"""The engine the user serves: ``outrider bench --server``.

``client`` streams chat completions from any OpenAI-compatible endpoint and scrapes its
``/metrics``; ``metrics`` reads vLLM's and SGLang's acceptance figures from them; ``measure`` runs
the concurrency levels and makes the served records (which ``plan --measured`` and ``plan
--calibrate`` read); ``offline`` decodes the same prompts here, plain and with the head, for the
served-vs-offline check; ``command`` joins them for the CLI.
"""
