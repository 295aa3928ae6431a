"""Running model-written code (the ``run_python`` tool): the sandbox it runs in (``runs``),
each task's scratch files (``workspaces``), and whether this host can provide it (``host``)."""
