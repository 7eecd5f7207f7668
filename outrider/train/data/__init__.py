"""Training data: conversations, chat templates and loss masks, regeneration, token datasets, the draft vocabulary."""
