"""HTTP: the app (server), shared request and response types (api), the OpenAI and
AUTOMATIC1111 routes side by side, draining and timeouts (http_server), the page. Imports the
service and the layers below it.
"""
