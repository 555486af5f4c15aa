# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/backup'

# Puts a stopped VM's disks back as they were in a snapshot (vm.revert) when the catalog is
# compiled, and returns the daemon's mutation {changed, vm}. The VM is not started. Every rule is
# vmhostd's: a running VM is refused (4090: stop it first), a snapshot whose disks no longer
# fit the VM is 2001, a copy that is not what it recorded is 2003 (no disk replaced); a refusal
# fails the compilation. Under --noop nothing is sent: it returns {noop, method, params}.
Puppet::Functions.create_function(:'vmhost::revert') do
  # @param vm the VM
  # @param snapshot the snapshot's name
  # @param opts timeout_s (longest the copy back may take; the daemon's default 3600), socket;
  #   any other key is sent to vmhostd as a param as given
  # @return [Hash] vm.revert's answer
  dispatch :revert do
    param 'String[1]', :vm
    param 'String[1]', :snapshot
    optional_param 'Hash[String[1], Data]', :opts
  end

  def revert(vm, snapshot, opts = {})
    PuppetX::Vmhost::Backup.function_call('vmhost::revert', 'vm.revert', { 'name' => vm, 'snapshot' => snapshot }, opts)
  end
end
