"""The fleet simulator: the shipped WCS controller (`replicas/wcs/controller.py`) and the router's decision
(`cluster/route.py`) over modelled engines, priced by named cost profiles, for GPU-class and fleet-sized
figures this project's CPU host cannot run. Every figure it produces is labelled simulated."""
