"""The tracker's HTTP routes: for clients (``public``), for nodes (``nodes``, with admission
in ``admission``) and the dashboard (``dashboard``)."""
