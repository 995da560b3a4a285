"""Measured costs: operators timed on the device (:mod:`.profiler`, ``plan profile``'s cache) and the gathered
gradient syncs' compressors timed and fitted (:mod:`.codec_profiler`)."""
