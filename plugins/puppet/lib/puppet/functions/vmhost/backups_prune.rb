# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/backup'

# Keeps a VM's newest `keep` backups in vmhostd's paths.backups and removes the others
# (vm.backups_prune) when the catalog is compiled, and returns the daemon's answer
# {removed, merged, kept} (backup directories, oldest first; `merged` the [increment, full]
# pairs merged because a kept increment's parent went). Every rule is vmhostd's (keep below 1
# is 2001 on `keep`; a chain to merge that does not check is 2003/4040 on `backup`, nothing
# removed); a refusal fails the compilation. Under --noop nothing is sent: it returns
# {noop, method, params}.
Puppet::Functions.create_function(:'vmhost::backups_prune') do
  # @param vm the VM whose backups are pruned (by the manifests' `vm`: it need not exist)
  # @param keep how many of its newest backups to keep
  # @param opts socket; any other key is sent to vmhostd as a param as given
  # @return [Hash] vm.backups_prune's answer
  dispatch :backups_prune do
    param 'String[1]', :vm
    param 'Integer', :keep
    optional_param 'Hash[String[1], Data]', :opts
  end

  def backups_prune(vm, keep, opts = {})
    PuppetX::Vmhost::Backup.function_call('vmhost::backups_prune', 'vm.backups_prune',
                                          { 'name' => vm, 'keep' => keep }, opts)
  end
end
