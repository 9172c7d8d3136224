"""Previews: a pod or admission review rendered as the webhook would change it (render), in worker processes
apart from the server's (workers)."""
