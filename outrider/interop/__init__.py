"""Other tools' layouts: export formats (``formats``: one registered object per format), reading
head checkpoints (``checkpoint``), engine facts (``engines``), LAUNCH.md (``launch``), compatibility
reports (``inspect``, ``draft_checks``) and the OpenAI-compatible client (``openai_client``).
Import the submodules directly; this package exports nothing."""
