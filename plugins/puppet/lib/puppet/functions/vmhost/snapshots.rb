# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/backup'

# Returns a VM's snapshots through vmhostd (vm.snapshots) when the catalog is compiled, oldest
# first, each as vm.snapshot answered it (name, created_at, live, consistency, reason, frozen,
# spec, disks, ...). A daemon refusal (4040: no such VM) fails the compilation.
Puppet::Functions.create_function(:'vmhost::snapshots') do
  # @param vm the VM
  # @param opts socket (vmhostd's API socket)
  # @return [Array] vm.snapshots' answer
  dispatch :snapshots do
    param 'String[1]', :vm
    optional_param 'Struct[{ Optional[socket] => String[1] }]', :opts
  end

  def snapshots(vm, opts = {})
    PuppetX::Vmhost::Backup.snapshots(vm, opts)
  rescue PuppetX::Vmhost::Error => e
    raise Puppet::Error, "vmhost::snapshots: #{e.message}"
  end
end
