"""Two ranks: report the world, pass a TF tensor round the ring and allreduce it."""

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from tests.support.report import report

comm = MPI.COMM_WORLD
rank, size = hf.rank(), hf.size()
sent = tf.constant(np.arange(6, dtype=np.float32) + 100 * rank)
received = np.empty(6, dtype=np.float32)
# Send straight from the eager tensor's buffer (zero copy) to the next rank.
comm.Sendrecv(sent, dest=(rank + 1) % size, recvbuf=received, source=(rank - 1) % size)
total = np.empty(6, dtype=np.float32)
comm.Allreduce(sent.numpy(), total)
report({"rank": rank, "size": size, "received": received.tolist(), "allreduced": total.tolist()})
