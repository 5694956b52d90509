"""``anyaccel env``: placeholder, completed by the launch work."""
def add_parser(sub):
    p = sub.add_parser("env", help="print versions, devices and the detected environment")
    p.set_defaults(func=lambda args: 0)
