"""The target side of training: online capture, hidden-state caches (ours and the peers'), layer streaming, INT4, data-parallel capture."""
