"""Pair configs (TOML) shipped with specjax; read with importlib.resources."""
