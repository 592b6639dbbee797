"""Parts of smdistributed shared by the framework front ends: rank discovery and the smddprun launcher."""
