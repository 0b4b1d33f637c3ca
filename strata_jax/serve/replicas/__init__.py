"""`serve --replicas N`: engine replicas behind one ingress, as a Ray Serve application."""
