#!/usr/bin/env bash
# Run by control-plane.yml's rabbitmq-init service (the RabbitMQ image, as root): imports vnfarm's
# definitions into the cluster and sets the users' passwords. Idempotent; run it again after
# adding a worker box's password file.
#
# definitions.json creates its users without a password (they cannot log in), and an import
# overwrites a user with what the file says: every run therefore sets every password again from
# /opt/vnfarm/passwords/<user name> (secrets/rabbitmq/ on the host, made by make-secrets).
set -euo pipefail
node=${RABBITMQ_NODE:-rabbit@rabbitmq-1}
passwords=/opt/vnfarm/passwords
# The CLI authenticates to the node with the cluster's cookie, read from $HOME.
install -m 0400 /run/secrets/rabbitmq_erlang_cookie "$HOME/.erlang.cookie"
ctl=(rabbitmqctl -n "$node")

"${ctl[@]}" await_startup
"${ctl[@]}" await_online_nodes 3
"${ctl[@]}" import_definitions /opt/vnfarm/definitions.json
# Worker users beyond definitions.json's box-1 come from the template (one user per box).
for file in "$passwords"/vnfarm-worker-*; do
  [ -e "$file" ] || continue
  id=${file##*/vnfarm-worker-}
  RABBITMQCTL="${ctl[*]}" bash /opt/vnfarm/add-worker-user "$id"
done
for file in "$passwords"/*; do
  [ -f "$file" ] || continue
  user=${file##*/}
  "${ctl[@]}" -q change_password "$user" "$(cat "$file")"
  echo "password set for $user"
done
# The image's own account is no longer needed once vnfarm's users exist (it can log in only from
# the node's own host anyway: rabbitmq.conf's loopback_users).
"${ctl[@]}" -q delete_user guest 2>/dev/null || true
"${ctl[@]}" -q list_users
