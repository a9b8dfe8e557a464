"""The weight transports by name (`weights.transport`): each line names the learner's sender, the generator's
receiver and the vLLM worker mixin of one transport (their bases and what each method is for: weights/base.py).
Adding a transport is its module in weights/ and its line here; `auto` picks among these four (weights.pick)."""

TRANSPORTS = {  # name: (sender, receiver, worker mixin); senders of one class are one object, mixins one base each
    "zmq": ("weights.files:FileSender", "weights.zmq:ZmqReceiver", "weights.files:BlobWorker"),
    "shm": ("weights.files:FileSender", "weights.shm:ShmReceiver", "weights.files:BlobWorker"),
    "nccl": ("weights.nccl:NcclSender", "weights.nccl:NcclReceiver", "weights.nccl:CollectiveWorker"),
    "ipc": ("weights.ipc:IpcSender", "weights.ipc:IpcReceiver", "weights.ipc:IpcWorker"),
}
