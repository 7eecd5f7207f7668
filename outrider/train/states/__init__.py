"""The target side of training (``side.TargetSide``): online capture, hidden-state caches (ours
and the peers'), layer streaming, INT4 weights, data-parallel capture."""
