"""What an engine plugs in: scheduler side, worker side, request lifecycle and transfers.

Submodules are imported explicitly (``from connector.nixl_engine import ...``) so that
importing the package never loads NIXL as a side effect.
"""
