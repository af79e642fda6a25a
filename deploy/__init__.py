"""Deployment files for pdserve: `ray up` cluster config, Ray Serve config and its application builder.

This folder is not part of the installed `pdserve` wheel. `deploy.pdserve_app:app`
is imported by Ray Serve from a checkout of the repository, whose root must be on
PYTHONPATH of every Ray node (deploy/cluster.yaml sets that up).
"""
