"""Fleet descriptions (`manifests/fleets/*.yaml`): replica groups, each a cost profile, a count and whether it
has a drafter. `forespark simulate ... --fleet` simulates one; `serve_config` writes it as a Serve config.

In Serve a fleet is an engine deployment whose replicas take their group by rank (`EngineGroup`), so one
router places over all of them. That holds for groups that share their resources: one GPU kind per
deployment is not needed (each replica profiles the GPU it landed on, and the router prices it by that
profile), but one tensor-parallel size is. A fleet that mixes tensor-parallel sizes becomes a deployment per
size, and the ingress sends each request to the deployment whose best replica keeps the most TPOT slack
(`cluster/fleet_backend.py`).

A group without a drafter is served with `wcs.policy: ar`: it never drafts, and it keeps the step-cost
profile the router prices it by (an engine without WCS reports none). Its drafter's weights stay loaded.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PROFILE_NAME = re.compile(r"^(?P<gpu>[a-z0-9]+)-(?P<model>[a-z0-9.]+)-tp(?P<tp>\d+)$")


class ReplicaGroup(BaseModel):
    """Replicas alike: a cost profile, how many, and whether they have a drafter (without one, an engine runs
    autoregressive decoding whatever the policy)."""

    model_config = ConfigDict(extra="forbid")

    profile: str
    count: int = Field(ge=1)
    drafter: bool = True


class FleetDescription(BaseModel):
    """A heterogeneous fleet as a YAML file describes it (`manifests/fleets/*.yaml`)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    groups: list[ReplicaGroup] = Field(min_length=1)

    @classmethod
    def load(cls, path: str | Path) -> "FleetDescription":
        import yaml

        return cls.model_validate(yaml.safe_load(Path(path).read_text()))


def group_name(group: ReplicaGroup, index: int) -> str:
    return f"{index}-{group.profile}" + ("" if group.drafter else "-no-drafter")


def serve_config(fleet: FleetDescription, base: dict[str, Any]) -> dict[str, Any]:
    """`base` (a Serve config of this project, e.g. `manifests/serve-gpu.yaml`) with its application's engine
    replicas made this fleet: `replica.groups` by rank, GPUs of the profiles' tensor-parallel size (a group at
    another size than the first overrides it, and becomes a deployment of its own). Raises ValueError for a fleet
    one application cannot hold."""
    tps = {}
    for group in fleet.groups:
        match = PROFILE_NAME.match(group.profile)
        if match is None and group.profile != "cpu-embedded":
            raise ValueError(f"profile {group.profile!r} names no GPU and tensor-parallel size (<gpu>-<model>-tp<N>)")
        tps[group.profile] = int(match["tp"]) if match else 0
    if 0 in tps.values() and len(set(tps.values())) > 1:
        raise ValueError(f"fleet {fleet.name!r} mixes the CPU profile with GPU ones: one application serves one or the other")
    doc = copy.deepcopy(base)
    apps = doc.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"the base Serve config must hold one application, not {len(apps)}")
    replica = apps[0].setdefault("args", {}).setdefault("replica", {})
    replica.pop("autoscaling", None)  # groups are fixed by rank
    replica.pop("num_replicas", None)
    tp = tps[fleet.groups[0].profile]
    engine = replica.setdefault("engine", {})
    if tp:
        replica["accelerator"] = "gpu"
        engine["tensor_parallel_size"] = tp
    else:
        replica["accelerator"] = "cpu"
    no_drafter = {"drafter": None} if engine.get("wcs", {}) is None else {"wcs": {"policy": "ar"}}

    def overrides(g: ReplicaGroup) -> dict[str, Any]:
        own = {} if g.drafter else dict(no_drafter)
        if tps[g.profile] != tp:  # another size: another deployment (`ReplicaConfig.by_tensor_parallel`)
            own["tensor_parallel_size"] = tps[g.profile]
        return {"engine": own} if own else {}

    replica["groups"] = [{"name": group_name(g, i), "count": g.count, **overrides(g)} for i, g in enumerate(fleet.groups)]
    return doc
