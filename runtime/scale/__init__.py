"""Scale-out on Ray Serve: the same app in front of replicas, the base-affinity router. Imports
the web app and the layers below it.
"""
