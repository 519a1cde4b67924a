"""Watching jobs while they run: `top` over status files, `attach` to jobs started without us."""
