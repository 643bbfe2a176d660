"""pdserve.operator: the kopf operator that turns an InferenceService into pools, Deployments and Services.

Importable only as ``pdserve.operator`` (the bare name ``operator`` is the standard library's).
"""
