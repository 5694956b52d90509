"""A strategy that lives outside anyaccel, as a user's package would hold one (see
docs/extending/strategies.md): ``step_average.py`` is the whole of it."""
