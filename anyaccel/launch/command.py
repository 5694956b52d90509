"""``anyaccel launch``: placeholder, completed by the launch work."""
def add_parser(sub):
    p = sub.add_parser("launch", help="launch a training script")
    p.set_defaults(func=lambda args: 0)
