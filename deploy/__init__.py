"""Deployment of the Flower apps over gRPC: a SuperLink and SuperNodes with TLS, optional node authentication.

``certs`` (CA and server certificate), ``keys`` (SuperNode authentication keys), ``connection`` (the
`flwr` CLI's SuperLink connection), ``processes`` (start and stop processes by recorded PID) and
``cluster`` (a local SuperLink plus N SuperNodes). The command line is ``python -m deploy``.
"""
