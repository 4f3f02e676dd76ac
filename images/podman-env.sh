# Sourced by images/*.sh: podman's storage and configuration in a folder of their own (nothing
# in /etc is touched), with the settings this kind of machine needs: runc (crun 1.8 refuses a
# hybrid cgroup layout), cgroupfs, and no default ulimits: containers inherit the host's (root
# in a sandbox may not set them; here even an unchanged RLIMIT_NPROC is refused).
# KVFENCE_IMAGES_STATE moves the folder; the images are cached there between runs.
state="${KVFENCE_IMAGES_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfence/images}"
mkdir -p "$state/storage" "$state/run"
cat > "$state/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$state/storage"
runroot = "$state/run"
CONF
cat > "$state/containers.conf" <<CONF
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_STORAGE_CONF="$state/storage.conf" CONTAINERS_CONF="$state/containers.conf"
