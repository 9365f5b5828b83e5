"""asyncio kits with no knowledge of Akri: in-process event fan-out and inotify watches."""
