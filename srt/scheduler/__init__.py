from radixlm.srt.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
