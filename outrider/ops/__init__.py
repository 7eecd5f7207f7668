"""Tensor pieces that decode, heads and train share: slot attention (``slot_attention``), CUDA
graph capture and the compile policy (``graphs``), seeded random streams (``seeds``). They import
base modules only. Import the submodules directly; this package exports nothing."""
