"""Training an EAGLE-3 draft head: data (``data``), the OpenAI-compatible endpoint client used to
regenerate responses (``openai_client``), and the stages that follow (vocabulary, capture,
training-time test, trainer). Import the submodules directly; this package exports nothing."""
