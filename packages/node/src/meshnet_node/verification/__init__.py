"""Catching nodes that compute wrong (docs/adr/0026): the node's side of an audit
(``audit``) and the head's (``verifier``)."""
