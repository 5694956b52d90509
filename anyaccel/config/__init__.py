"""Configuration: one schema (``schema.py``), its YAML file (``file.py``), the interactive wizard
(``wizard.py``) and the ``anyaccel config`` command (``command.py``)."""
