"""DRA kubelet plugin (driver ``akri.sh``): ResourceSlices, prepare/unprepare, CDI."""
