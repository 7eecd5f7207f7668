"""Training an EAGLE-3 draft head, by stage: ``options`` (``TrainOptions``, a run's options typed
once), ``data`` (conversations, chat templates and loss masks, regeneration, token datasets, the
draft vocabulary), ``states`` (the target side: online, hidden-state caches ours and the peers',
layer streaming, INT4, data-parallel capture), ``loop`` (trainer, training-time test, losses,
metrics, logs, checkpoints). Import the submodules directly; this package exports nothing."""
