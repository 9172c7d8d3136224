from webhook.pull import entrypoint

entrypoint()
