"""Weights arriving at a server, by every path: `weight_stream.py` the gRPC stream of pieces
and the checks every path shares (versions, names, shapes, dtypes); `transfer.py` device to
device with jax.experimental.transfer; the tcp bulk path: `bulk.py` the offers and the relay
protocol, `bulk_pull.py` the receiving side, `slabs.py` the host memory it lands in (shared by
the servers of one host), `staging.py` onto an accelerator through a few host buffers;
`pulls.py` a server's side of a pull.

Imports: serving.core and below.
"""
