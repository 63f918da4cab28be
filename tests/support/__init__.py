"""Shared test helpers, one module per concern: the real services and how to reach them
(``services``: vLLM, the proxy as a process, free ports), stored calls made by hand (``records``),
the tool schemas the engine tests offer (``tools``), multi-rank launches (``torchrun``)."""
