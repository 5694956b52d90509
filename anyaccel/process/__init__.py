"""This process in its job: where it stands (``job``), its process group (``process_group``), how
it ends and what its forks inherit (``lifetime``), and what it does when the scheduler preempts it
(``preemption``).

Empty on purpose: importing the package imports none of its modules.
"""
