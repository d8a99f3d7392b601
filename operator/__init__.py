"""kvpilot's Kubernetes operator: InferenceEngine resources in, engine Deployments out.

- render.py: spec -> the child objects (pure)
- status.py: the child Deployment -> status and conditions (pure)
- reconcile.py: one reconcile pass (read, apply, write status)
- handlers.py: the kopf wiring; run.py: `kvpilot operator`
- kube.py: the API client; naming.py: names and labels; rbac.yaml: the API rights it needs
"""
