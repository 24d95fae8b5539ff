"""This process's cluster routers by engine deployment name (`cluster/router.py` registers itself at start).

An ingress over several engine deployments (one per tensor-parallel size) compares their best placements before
it calls one (`cluster/fleet_backend.py`). A module of its own: Serve pickles the router's module by value, so a
registry there would be a copy in each process that unpickles it, not the one the ingress reads.
"""

from __future__ import annotations

from typing import Any

ROUTERS: dict[str, Any] = {}  # deployment name -> AcceptanceHeadroomRouter
