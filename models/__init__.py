"""Drafter checkpoints shipped with specjax; read with importlib.resources."""
